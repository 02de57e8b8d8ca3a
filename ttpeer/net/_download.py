"""One HTTP/1.1 GET on its own TLS stream, for blob bodies, without httpx.

Why: OpenSSL hands over one 16 KiB TLS record per read, and httpx/httpcore/h11 spend
about 40 us of Python on each (events, context managers, checkpoints). On a busy
machine the client's CPU was the download's speed (``scripts/bench/relay``: about
0.5x a plain TLS download). Here a record costs one ``receive_some`` and one append.

What it does: send a request head, read the answer's head (at most 64 KiB), then read
a body framed by ``content-length``, which the relay sends with every blob and every
error; an answer without one, or chunked, is refused rather than guessed at. An
answer read to its end leaves the connection ``reusable`` for the next GET (a new
TLS connection costs two round trips, more through a proxy). Opening the stream
(pinned context, CONNECT proxy), keeping one spare, authentication and error mapping
are the caller's (``RelayClient``); this module raises ``OSError`` subclasses,
``trio`` stream errors and ``Malformed``.

The body goes into a ``Body``: the chunks OpenSSL returned, joined once at the end
(appending to one growing bytearray copied a large blob several times over), and
hashed as they arrive, while the relay is still sending, rather than after.

Timeouts: the caller passes a cancel scope; reads that return data push its deadline
on to ``timeout`` seconds after them, so a stalled answer ends (between 7/8 of the
timeout and the timeout after its last byte), a slow but moving one not. Moving a
deadline costs trio a few microseconds, so it moves at most every ``timeout / 8``.
"""

from __future__ import annotations

import hashlib
from typing import BinaryIO

import trio

MAX_HEAD_BYTES = 65536
_READ_BYTES = 256 * 1024  # OpenSSL returns one record per read at most; this just never limits it


class Malformed(Exception):
    """The answer is not HTTP/1.1 the way the relay speaks it."""


def request_head(target: str, host: str, headers: dict[str, str]) -> bytes:
    """The bytes of a body-less GET for ``target`` on ``host`` (``HOST:PORT``)."""
    lines = [f"GET {target} HTTP/1.1", f"host: {host}", "accept-encoding: identity",
             *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def parse_head(raw: bytes) -> tuple[int, dict[str, str]]:
    """Status and header fields (names lower-cased) of an answer head without its blank line."""
    status_line, *lines = raw.decode("latin-1").split("\r\n")
    version, _, rest = status_line.partition(" ")
    code = rest[:3]
    if version != "HTTP/1.1" or not (code.isdigit() and code.isascii()):
        raise Malformed(f"status line {status_line[:80]!r}")
    headers: dict[str, str] = {}
    for line in lines:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            raise Malformed(f"header line {line[:80]!r}")
        headers[name.lower()] = value.strip()  # the relay repeats no field that matters here
    return int(code), headers


# What ``receive_some`` returns: trio's stream interface promises ``bytes | bytearray``
# (an SSLStream hands over OpenSSL's bytes; trio's memory streams, used in tests, bytearray).
# Both are kept as they came, uncopied; ``b"".join`` takes either.
Chunk = bytes | bytearray


class Body:
    """Bytes as they arrive: the chunks, their total ``size`` and their running sha256."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.parts: list[Chunk] = []
        self.size = 0
        self.sha256 = hashlib.sha256()

    def append(self, chunk: Chunk) -> None:
        self.parts.append(chunk)
        self.size += len(chunk)
        self.sha256.update(chunk)


class FileBody(Body):
    """A ``Body`` that goes to a file as it arrives (a model state: never whole in
    memory). ``parts`` stays empty; ``clear`` starts the file over."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        super().__init__()

    def clear(self) -> None:
        super().clear()
        self._file.seek(0)
        self._file.truncate()

    def append(self, chunk: Chunk) -> None:
        self._file.write(chunk)
        self.size += len(chunk)
        self.sha256.update(chunk)


class Answer:
    """The answer to one GET: ``status``, ``headers``, ``length``, then the body.

    ``started``: some of it arrived (else a reused connection may just have gone stale).
    ``reusable``: read to its end, nothing after it, and the server keeps the connection.
    """

    def __init__(self, stream: trio.SSLStream, idle: trio.CancelScope,
                 timeout: float) -> None:
        self.stream = stream
        self.status = 0
        self.headers: dict[str, str] = {}
        self.length = 0  # of the body, from content-length
        self.started = False
        self.reusable = False
        self._idle = idle
        self._timeout = timeout
        self._next_push = trio.current_time() + timeout / 8
        self._rest = b""  # body bytes that came with the head

    async def _receive(self) -> Chunk:
        chunk = await self.stream.receive_some(_READ_BYTES)
        now = trio.current_time()
        if now >= self._next_push:
            self._idle.deadline = now + self._timeout
            self._next_push = now + self._timeout / 8
        return chunk

    async def read_head(self) -> None:
        raw = b""
        while (end := raw.find(b"\r\n\r\n")) < 0:
            if len(raw) > MAX_HEAD_BYTES:
                raise Malformed(f"an answer head over {MAX_HEAD_BYTES} bytes")
            chunk = await self._receive()
            if not chunk:
                raise EOFError("the connection closed before the answer's head ended")
            self.started = True
            raw += chunk
        if end > MAX_HEAD_BYTES:
            raise Malformed(f"an answer head over {MAX_HEAD_BYTES} bytes")
        self.status, self.headers = parse_head(raw[:end])
        if "transfer-encoding" in self.headers:
            raise Malformed("a chunked answer (the relay frames every body with content-length)")
        length = self.headers.get("content-length", "")
        if not (length.isdigit() and length.isascii() and len(length) <= 20):
            raise Malformed(f"content-length {length[:30]!r}")
        self.length = int(length)
        self._rest = raw[end + 4:]

    async def read_into(self, parts: Body, most: int | None = None) -> None:
        """Append the body (or its first ``most`` bytes) to ``parts``, chunk by chunk; call
        once. Raises ``EOFError`` if the connection ends first; what arrived stays appended."""
        want = self.length if most is None else min(most, self.length)
        extra = len(self._rest) > want  # more than the body: not a connection to reuse
        if self._rest:
            piece, self._rest = self._rest[:want], b""
            parts.append(piece)
            want -= len(piece)
        while want > 0:
            chunk = await self._receive()
            if not chunk:
                raise EOFError(f"the connection closed {want} bytes before the answer's end")
            if len(chunk) > want:  # never read past the body
                chunk, extra = chunk[:want], True
            parts.append(chunk)
            want -= len(chunk)
        self.reusable = (most is None or most >= self.length) and not extra and \
            "close" not in self.headers.get("connection", "").lower()
