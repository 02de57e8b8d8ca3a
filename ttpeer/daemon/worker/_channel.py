"""The daemon's channel to a worker process: bounded, versioned frames over a pipe.

A frame is a 4-byte big-endian length, then that many bytes of canonical JSON (an
object). Frames are small by construction: tensors and states never travel in them;
they move through files in the home, written atomically (``_workfiles``), and a
frame names the file. A frame over ``MAX_FRAME`` or one that is not a JSON object
is a broken peer: the reader raises ``ChannelError`` and the supervisor treats the
worker as dead.

Every frame carries ``"v": VERSION``; a worker started by another ttpeer version
is refused at its first frame instead of misreading the next one. What the frames
say, and the types they say it with, is ``_workermsg``'s.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Protocol

VERSION = 1
MAX_FRAME = 1 << 20
_LEN = struct.Struct(">I")


class ChannelError(Exception):
    """The other end sent something that is not a frame of this version, or went away."""


class _Receive(Protocol):
    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray: ...


class _Send(Protocol):
    async def send_all(self, data: bytes | bytearray | memoryview) -> None: ...


def pack(obj: dict[str, Any]) -> bytes:
    body = json.dumps({"v": VERSION, **obj}, separators=(",", ":"), sort_keys=True).encode()
    if len(body) > MAX_FRAME:
        raise ValueError(f"frame of {len(body)} bytes exceeds {MAX_FRAME}: large data goes through files")
    return _LEN.pack(len(body)) + body


class FrameReader:
    """Reads frames from a trio receive stream, each without its version (checked);
    ``None`` at a clean end of stream."""

    def __init__(self, stream: _Receive) -> None:
        self._stream = stream
        self._buf = bytearray()

    async def _fill(self, n: int) -> bool:
        while len(self._buf) < n:
            chunk = await self._stream.receive_some(65536)
            if not chunk:
                return False
            self._buf += chunk
        return True

    async def read(self) -> dict[str, Any] | None:
        if not await self._fill(_LEN.size):
            if self._buf:
                raise ChannelError("stream ended inside a frame header")
            return None
        (size,) = _LEN.unpack(self._buf[: _LEN.size])
        if size > MAX_FRAME:
            raise ChannelError(f"frame of {size} bytes announced (at most {MAX_FRAME})")
        if not await self._fill(_LEN.size + size):
            raise ChannelError("stream ended inside a frame")
        body = bytes(self._buf[_LEN.size : _LEN.size + size])
        del self._buf[: _LEN.size + size]
        try:
            obj = json.loads(body)
        except ValueError as exc:
            raise ChannelError(f"frame is not JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise ChannelError("frame is not a JSON object")
        version = obj.pop("v", None)
        if version != VERSION:
            raise ChannelError(f"frame of channel version {version!r}, this side speaks {VERSION}")
        return obj


async def send(stream: _Send, obj: dict[str, Any]) -> None:
    await stream.send_all(pack(obj))
