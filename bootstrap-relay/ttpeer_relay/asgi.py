"""The little HTTP layer under the relay: requests, responses, errors, over ASGI.

No framework: a request is read through ``receive`` with a byte cap, a response
is either a small JSON body or a file streamed in chunks read off the event loop.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

import trio
from ttpeer_wire import ErrorCode, error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# A blob is sent in reads of this size, each a hop to a worker thread and a pass through
# hypercorn and h11: 1 MiB took about 20% less of the relay's CPU per blob than 256 KiB
# (scripts/bench/relay), for 1 MiB more buffered per download in flight.
_CHUNK = 1024 * 1024
_DIGITS = re.compile(r"[0-9]{1,20}")


class HttpError(Exception):
    """Answer the request with ``status`` and ``{"error": message, "code": code}``
    (``ttpeer_wire.error_body``; the codes are ``ttpeer_wire.ErrorCode``)."""

    def __init__(self, status: int, code: ErrorCode, message: str, *,
                 retry_after: float | None = None, records: list[bytes] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.records = records
        self.headers: list[tuple[str, str]] = []
        if retry_after is not None:
            self.headers.append(("retry-after", str(max(1, math.ceil(retry_after)))))


class Disconnected(Exception):
    """The client went away while its request body was being read."""


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    client: str
    http_version: str
    receive: Receive
    body_done: bool = False  # the whole body has been received
    # Slow-drip defence: after ``grace`` seconds the body must have arrived at
    # ``min_rate`` bytes a second on average, or the request ends with 408.
    min_rate: float = 0.0
    grace: float = math.inf
    _started: float | None = None
    _received: int = 0

    @classmethod
    def from_scope(cls, scope: Scope, receive: Receive) -> Request:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
        client = scope.get("client") or ("unknown", 0)
        version = scope.get("http_version", "1.1")
        return cls(scope["method"], scope["path"], query, headers, client[0], version, receive)

    @property
    def declared_length(self) -> int | None:
        """Content-Length, if it is plain ASCII digits (``isdigit`` also takes '¹')."""
        declared = self.headers.get("content-length", "")
        return int(declared) if _DIGITS.fullmatch(declared) else None

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives. Raises ``Disconnected``, and ``HttpError`` 408 when it
        arrives slower than ``min_rate`` allows."""
        while True:
            message = await self._next_body_message()
            if message["type"] == "http.disconnect":
                raise Disconnected
            chunk = message.get("body", b"")
            self._received += len(chunk)
            if chunk:
                yield chunk
            if not message.get("more_body", False):
                self.body_done = True
                return

    async def _next_body_message(self) -> Message:
        if self.min_rate <= 0:
            return await self.receive()
        if self._started is None:
            self._started = trio.current_time()
        # The next byte is due when the average rate would fall under min_rate.
        due = self._started + max(self.grace, (self._received + 1) / self.min_rate)
        with trio.move_on_at(due):
            return await self.receive()
        raise HttpError(408, ErrorCode.TOO_SLOW, f"request body arrives slower than {self.min_rate:.0f} bytes a second")

    async def body(self, limit: int) -> bytes:
        """The whole body; 413 as soon as it passes ``limit`` bytes."""
        declared = self.declared_length
        if declared is not None and declared > limit:
            raise HttpError(413, ErrorCode.TOO_LARGE, f"body is over the {limit}-byte cap")
        parts: list[bytes] = []
        size = 0
        async for chunk in self.chunks():
            size += len(chunk)
            if size > limit:
                raise HttpError(413, ErrorCode.TOO_LARGE, f"body is over the {limit}-byte cap")
            parts.append(chunk)
        return b"".join(parts)

    async def json(self, limit: int) -> dict[str, Any]:
        raw = await self.body(limit)
        try:
            value = json.loads(raw)
        except (UnicodeDecodeError, ValueError):
            raise HttpError(400, ErrorCode.BAD_REQUEST, "body is not JSON") from None
        if not isinstance(value, dict):
            raise HttpError(400, ErrorCode.BAD_REQUEST, "body must be a JSON object")
        return value

    async def finish(self, drain_limit: int) -> list[tuple[str, str]]:
        """HTTP/1, before answering early: drop a small unread body so the connection
        can be reused; for a large one, the answer's extra headers close it."""
        if self.body_done or self.method in ("GET", "HEAD"):
            return []
        declared = self.declared_length
        if declared is not None and declared <= drain_limit:
            try:
                await self.drain(drain_limit)
                return []
            except (HttpError, Disconnected):
                pass
        return [("connection", "close")]

    @property
    def is_http1(self) -> bool:
        return self.http_version.startswith("1")

    async def discard_rest(self, *, timeout: float | None) -> None:
        """Swallow what is left of the body until its end or a disconnect (or
        ``timeout`` seconds). Hypercorn feeds the body through a small queue; if
        nobody empties it, an early answer cannot complete."""
        with trio.move_on_after(float("inf") if timeout is None else timeout):
            while not self.body_done:
                message = await self.receive()
                if message["type"] == "http.disconnect" or not message.get("more_body", False):
                    self.body_done = True

    async def drain(self, limit: int) -> int:
        """Read and drop the body (413 past ``limit``); returns its size."""
        size = 0
        async for chunk in self.chunks():
            size += len(chunk)
            if size > limit:
                raise HttpError(413, ErrorCode.TOO_LARGE, f"body is over the {limit}-byte cap")
        return size


@dataclass
class Response:
    status: int
    body: bytes = b""
    headers: list[tuple[str, str]] = field(default_factory=list)
    content_type: str = "application/json"


@dataclass
class FileResponse:
    """``length`` bytes of the open ``source`` from ``start``; headers only when ``head``.

    ``send_response`` closes ``source``.
    """

    status: int
    source: Any  # a trio async file opened for binary reading
    start: int
    length: int
    headers: list[tuple[str, str]] = field(default_factory=list)
    head: bool = False


def json_response(status: int, value: Any, headers: list[tuple[str, str]] | None = None) -> Response:
    body = json.dumps(value, separators=(",", ":")).encode()
    return Response(status, body, headers or [])


def error_response(error: HttpError) -> Response:
    return json_response(error.status, error_body(error.code, error.message, error.records), error.headers)


async def send_response(send: Send, response: Response | FileResponse) -> None:
    if isinstance(response, Response):
        headers = [("content-type", response.content_type),
                   ("content-length", str(len(response.body))), *response.headers]
        await send({"type": "http.response.start", "status": response.status,
                    "headers": _encode(headers)})
        await send({"type": "http.response.body", "body": response.body})
        return
    headers = [("content-type", "application/octet-stream"),
               ("content-length", str(response.length)), *response.headers]
    async with response.source as source:
        await send({"type": "http.response.start", "status": response.status,
                    "headers": _encode(headers)})
        if response.head or response.length == 0:
            await send({"type": "http.response.body", "body": b""})
            return
        await source.seek(response.start)
        left = response.length
        while left > 0:
            chunk = await source.read(min(_CHUNK, left))
            if not chunk:  # truncated underneath us: end the stream short, not cleanly
                raise OSError(f"blob file ended {left} bytes early")
            left -= len(chunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": left > 0})


def _encode(headers: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
